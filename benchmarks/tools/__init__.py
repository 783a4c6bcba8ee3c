"""Tools that measure nothing of zerolm themselves: the figures drawn from benchmarks/results/, a GPU profile's
kernel time by kind, where the test suite's CPU time goes, and how reliably its GCS server starts."""
