"""Serving a trained model over HTTP (`zerolm serve`): the engine that decodes every request's choices
together on one device (`engine`), OpenAI's completions request and response (`completions`), and the
Starlette app with its page, run by uvicorn (`app`).

May import: core, config, model, parallel, data, checkpoint, plan, compile, observe, eval, hf, train.
"""
