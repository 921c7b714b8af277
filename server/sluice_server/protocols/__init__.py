"""Wire protocols, one module each (route plus formatter) on the core's event loop."""
