"""core/bucket/url.py: S3's bucket-naming rules and the key rules, checked before any request (issue #34, class 3)."""

from __future__ import annotations

import pytest

from core.bucket.url import check_bucket_url, object_and_folder


@pytest.mark.parametrize(("url", "says"), [
    ("s3://Bad_Bucket!/runs/x", "holds a character other than lowercase letters"),
    ("s3://UpperCase/runs/x", "holds a character other than lowercase letters"),
    ("s3://under_score/runs/x", "holds a character other than lowercase letters"),
    ("s3://-leading/runs/x", "does not begin and end with a letter or digit"),
    ("s3://ab/runs/x", "has 2 characters, not 3-63"),
    ("s3://" + "b" * 64 + "/runs/x", "has 64 characters, not 3-63"),
    ("s3://two..dots/runs/x", "holds two adjacent periods"),
    ("s3://192.168.5.4/runs/x", "is formatted as an IP address"),
    ("s3://xn--bucket/runs/x", "has a prefix or suffix S3 reserves"),
    ("s3:///runs/x", "is empty"),
    ("s3://bucket/../../etc", "holds a '.' or '..' segment"),
    ("s3://bucket/runs/./x", "holds a '.' or '..' segment"),
    ("s3://bucket/runs//x", "holds an empty segment"),
    ("s3://bucket//runs/x", "holds an empty segment"),
    ("s3://bucket/runs/x\ny", "holds a control character"),
    ("s3://bucket/runs/x\x7f", "holds a control character"),
    ("s3://bucket/" + "k" * 1025, "is 1025 bytes, above S3's 1024"),
    ("gs://bucket/../x", "holds a '.' or '..' segment"),
])
def test_a_url_breaking_the_rules_is_refused_naming_it_and_the_rule(url: str, says: str) -> None:
    with pytest.raises(ValueError) as refused:
        check_bucket_url(url)
    line = str(refused.value)
    assert line.startswith(f"{url!r}: ") and says in line and "\n" not in line


@pytest.mark.parametrize("url", ["s3://tokenmill-tests/runs/x", "s3://my.bucket-1/runs/x/", "s3://abc",
                                 "s3://bucket/corpus/a file (1).jsonl", "s3a://bucket/runs/x",
                                 "gs://Any_Bucket/runs/x", "s3://bucket/" + "k" * 1024])
def test_a_url_within_the_rules_passes_unchanged(url: str) -> None:
    assert check_bucket_url(url) == url


def test_a_key_that_is_an_object_and_a_folder_at_once_is_found() -> None:
    assert object_and_folder({"run.yaml", "docs/a.parquet", "shards/index.parquet"}) is None
    assert object_and_folder({"run.yaml", "run.yaml/x"}) == ("run.yaml", "run.yaml/x")
    assert object_and_folder({"shards/index.parquet", "shards/index.parquet/a/b"}) == ("shards/index.parquet",
                                                                                     "shards/index.parquet/a/b")
