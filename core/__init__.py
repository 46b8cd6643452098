"""Foundation every stage stands on: errors, atomic writes, the config base, the run-dir layout and lock, and
the formats (document and shard schemas, the shard writer and reader, the shard index, reading documents).

``pipeline``, ``tokenization`` and ``trainer`` import from here; ``core`` imports none of them.
"""
