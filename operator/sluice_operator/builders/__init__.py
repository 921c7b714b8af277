"""Pure manifest builders: typed StreamingModel in, plain dicts out. No kopf, no API client.

One module per child kind; `sluice_operator.kinds` lists them with their API coordinates.
"""
