"""llama-server as a thing: its API, its command line, its files and formats.

decoder       the llama-server client: its HTTP API over the unix socket, typed
answers       what llama-server answers, as values: refusals, counts, timings, a slot's context
llama_server  a llama-server child's command line
openvino      the OpenVINO engine: its binary, devices, variables, the static path
slots         the slots onebitd owns on a llama-server: the FIFO wait queue, affinity
chatform      Anthropic's and OpenAI Responses' bodies in llama-server's chat form (pure)
statefile     a slot state file read back: tokens, each KV cache's K and V rows, a recurrent memory's R and S
statediff     one slot state file measured against another, part by part, layer by layer (scripts/slotdiff)
gguf          a GGUF header's shape: what sizes a model's caches, what its memory is made of (pure)
region        a saved slot's rows written into the region the decoder lent
share_worker  a ``worker`` provider program for the share route (``python -m``)
"""
