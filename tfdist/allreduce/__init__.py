"""The all-reduce engine under `tfdist.strategies`' all-reduce strategies (`engine`)."""
