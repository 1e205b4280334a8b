"""The face onebitd shows its clients: llama-server's, OpenAI's and Anthropic's APIs.

front      the ASGI app: admission, errors, per-request cancel scopes, the route line
access     who may ask and what they may send (Host, Origin, API key, the body)
endpoints  for every path, who answers it (routed, on a slot, relayed, local, refused)
local      what onebitd answers itself (health, metrics, the model list, /slots while off)
relayed    the requests relayed as they are, whole or as a replay's stream
hangup     a client's hang-up: what it cancels, and a stream left to run detached
predict    Vertex AI's prediction served, each instance through the endpoint table
serving    which model serves a request, as the front sees it
cors       who may call from a browser page, as llama-server answers it
vertex     Vertex AI's prediction and health routes (pure checks)
"""
