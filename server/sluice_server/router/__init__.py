"""The router (`sluice-server router`, also `activator`): sends each request for a listed
model to one of its Ready pods, holding it with keep-alives while none is ready, and relays
the answer unchanged."""
