"""The face onebitd shows its clients: llama-server's, OpenAI's and Anthropic's APIs.

front      the ASGI app: admission, errors, per-request cancel scopes, the route line
endpoints  for every path, who answers it (routed, on a slot, relayed, local, refused)
cors       who may call from a browser page, as llama-server answers it
vertex     Vertex AI's prediction and health routes (pure checks)
"""
