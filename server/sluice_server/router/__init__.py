"""The router: places each request on a replica of its model and relays the stream."""
