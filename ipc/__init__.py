"""loraplex.ipc: the wire protocol and the sockets that carry it.

Messages are typed, validated dataclasses (protocol: the one import point for every
message class), encoded as one msgpack map each with bounded decoding (codec), sent
over ZMQ through one typed wrapper (sockets) at endpoints derived from a private
runtime directory (runtime_dir). The client library is loraplex.ipc.client. Pure
Python + msgpack + pyzmq: this package never imports torch or numpy, so clients and
policy code stay light.
"""
