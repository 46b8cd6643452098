"""Training batches: the shard loader, the source mixture, document masks, the chat (SFT) loss."""
