"""HTTP/1.1 bytes, both ends: knows nothing of onebit's routes or models.

framing   the parsers (llhttp through httptools) and onebitd's rules on them, no I/O
server    the front's server: ASGI over trio's sockets, one task per connection, hang-up watch
respond   the way back to the client: the error envelope, first-byte timing, the ASGI types
wire      HTTP/1.1 to a llama-server over its unix socket: keep-alive pool, replies framed
"""
