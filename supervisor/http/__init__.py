"""HTTP/1.1 bytes, both ends: knows nothing of onebit's routes or models.

framing/    the parsers (llhttp through httptools) with onebitd's rules, and the response writers; no I/O
server      the front's server: binds, accepts, stops (ASGI over trio's sockets)
connection  one client connection's loop: keep-alive, the idle timeout, the write deadline
watch       a request's HangUp and the one watcher task per connection
asgi        a request as the ASGI app sees it: scope, receive (the body's deadline), send
respond     the way back to the client: the error envelope, first-byte timing, the ASGI types
wire        HTTP/1.1 to a llama-server over its unix socket: keep-alive pool, replies framed
"""
