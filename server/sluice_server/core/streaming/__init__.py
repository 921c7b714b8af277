"""One stream from the engine to the socket: the per-stream buffer (stream), the one events
loop every protocol formats (events), the keep-alive timer (keepalive), and the recent
streams a `Last-Event-ID` reconnect is answered from (reconnects).
"""
