"""A run dir in an object-store bucket: its URL, its lock, its local working copy, the store's errors."""
