"""What training records: the metrics sink, telemetry, trackers, segments and consumed rows."""
