"""Message declarations, one module per boundary (client, replies, admin, engine,
cache, cpu, grammar), and their machinery: the base class and registry (base), the checkers
compiled from field annotations (fields) and the value rules fields declare (checks).

Everything outside this package imports messages and their bounds through
`loraplex.ipc.protocol`, which loads every module here so the registry is complete
before anything is decoded (tests/test_boundaries.py holds the rule). A new module
added here must also be imported there.
"""
