"""Bucket URLs (``s3://bucket/key``) checked where they enter, before any request is sent.

A URL reaches tokenmill from the command line (``--run-dir``, ``query RUN_DIR``), a recipe's ``run_dir`` and a
manifest's source ``path``; each of those routes calls :func:`check_bucket_url` (through
:func:`pipeline.objects.check_url` or :func:`core.bucket.lock.split_url`), so a bucket name botocore would refuse
(``ParamValidationError``) or a key the store would answer ``400 Bad Request`` for is one line naming the URL and
the rule, never a request and never a traceback.
"""

from __future__ import annotations

import ipaddress
import re

S3_SCHEMES = ("s3", "s3a")
"""Schemes whose bucket must follow S3's bucket-naming rules (other fsspec stores get the key rules only)."""
BUCKET_CHARS = re.compile(r"^[a-z0-9][a-z0-9.-]*[a-z0-9]$")
MIN_BUCKET_CHARS, MAX_BUCKET_CHARS = 3, 63
"""S3's bucket-naming rules (docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html)."""
RESERVED_BUCKET_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
RESERVED_BUCKET_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")
MAX_KEY_BYTES = 1024
"""S3's limit on an object key, in UTF-8 bytes."""
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def check_bucket_url(url: str) -> str:
    """``url`` when its bucket and key follow the store's rules; ValueError naming the URL and the rule otherwise.

    Bucket (``s3://``, ``s3a://``): 3-63 characters of lowercase letters, digits, ``.`` and ``-``, beginning and
    ending with a letter or digit, no ``..``, not an IP address, no reserved prefix or suffix. Key (every scheme):
    at most 1024 UTF-8 bytes, no control characters, no empty, ``.`` or ``..`` segment (one trailing ``/`` is a
    prefix's and allowed).
    """
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if scheme.lower() in S3_SCHEMES:
        problem = bucket_name_problem(bucket)
        if problem is not None:
            raise ValueError(f"{url!r}: bucket name {bucket!r} {problem}; give s3://BUCKET/KEY with a bucket "
                             "named by S3's rules: 3-63 lowercase letters, digits, '.' and '-'")
    problem = key_problem(key)
    if problem is not None:
        raise ValueError(f"{url!r}: key {problem}; give the object's or prefix's key as it is in the bucket "
                         "(e.g. s3://bucket/runs/NAME)")
    return url


def bucket_name_problem(bucket: str) -> str | None:
    """What breaks S3's bucket-naming rules in ``bucket``, or None when it follows them."""
    if not bucket:
        return "is empty"
    if not MIN_BUCKET_CHARS <= len(bucket) <= MAX_BUCKET_CHARS:
        return f"has {len(bucket)} characters, not {MIN_BUCKET_CHARS}-{MAX_BUCKET_CHARS}"
    if not BUCKET_CHARS.match(bucket):
        return "holds a character other than lowercase letters, digits, '.' and '-' (or does not begin and end " \
               "with a letter or digit)"
    if ".." in bucket:
        return "holds two adjacent periods"
    if _is_ip_address(bucket):
        return "is formatted as an IP address"
    if bucket.startswith(RESERVED_BUCKET_PREFIXES) or bucket.endswith(RESERVED_BUCKET_SUFFIXES):
        return "has a prefix or suffix S3 reserves"
    return None


def key_problem(key: str) -> str | None:
    """What makes ``key`` (the URL's part after the bucket) unusable, or None."""
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        return f"is {len(key.encode('utf-8', 'surrogatepass'))} bytes, above S3's {MAX_KEY_BYTES}"
    if CONTROL_CHARS.search(key):
        return "holds a control character"
    if not key:
        return None
    segments = key.removesuffix("/").split("/")
    if any(segment in (".", "..") for segment in segments):
        return "holds a '.' or '..' segment (a key is a name, not a path to resolve)"
    if "" in segments:
        return "holds an empty segment ('//' or a leading '/')"
    return None


def object_and_folder(rels: set[str]) -> tuple[str, str] | None:
    """``(key, key under it)`` when a key of a run dir in a bucket is an object and also a prefix of others, else None.

    A bucket may hold ``run.yaml`` and ``run.yaml/x`` side by side; a local copy cannot hold both a file and a
    folder at one path, so the pull or mirror would fail half-way (``IsADirectoryError``, ``FileExistsError``).
    """
    for rel in sorted(rels):
        parts = rel.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder in rels:
                return folder, rel
    return None


def _is_ip_address(bucket: str) -> bool:
    try:
        ipaddress.ip_address(bucket)
    except ValueError:
        return False
    return True
