"""Arrow token shards: writer, reader and index (store), checked opening, chat shards, datasets view."""
