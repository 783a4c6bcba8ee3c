"""Hugging Face transformers: the layouts a zerolm model converts to (`layouts`: one name table per layout,
read both ways), the config.json keys import accepts (`config_keys`), `zerolm export-hf` (`export`) and
`zerolm import-hf` (`importer`).

May import: core, config, model, parallel, data, checkpoint, plan, compile, observe, eval.
"""
