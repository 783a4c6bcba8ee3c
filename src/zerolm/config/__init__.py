"""The typed, frozen config tree (`tree`: YAML with `extends:`, `--set` overrides, each section checked at
load, the one-line error that names the file and key), the base every section shares (`section`) and the
model's section (`model`: the decoder's shape and layout settings).

May import: core.
"""
