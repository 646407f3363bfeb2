"""Structured outputs: a request's grammar (``StructuredOutputsParams``) compiled once with
llguidance, and each sample's matcher, advanced by the tokens it has drawn.

``grammar`` turns a spec into a grammar and checks it (the frontend refuses what cannot be
enforced exactly); ``cache`` compiles grammars off the engine's step loop and keeps each
request's matcher in step with its outputs. The token masks themselves are the model
runner's (``duoserve.worker.grammar_masks``).
"""
