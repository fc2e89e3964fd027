"""Message declarations, one module per boundary side (client, replies, admin).

Import messages through `loraplex.ipc.protocol`, which loads every module here
so the registry is complete before anything is decoded. A new module added
here must also be imported there.
"""
