"""The typed, frozen config tree (`tree`: every section, each checked, and the checks between them), its loading
(`load`: YAML with `extends:`, `--set` overrides, the one-line error that names the file and key), the base every
section shares (`section`), the model's section (`model`: the decoder's shape and layout settings) and the
sampler's (`sampling`).

May import: core.
"""
