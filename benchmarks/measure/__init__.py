"""What a user runs to measure zerolm: the step against the naive one (`make bench`), MFU on a device, PyTorch on
the same shapes and side by side with zerolm, serving under load, the loader, `zerolm prepare` and `zerolm
contamination` at corpus size, checkpoints, lm-evaluation-harness requests, and the step clock."""
