"""The descriptor pool of mmguard's generated messages (see scripts/gen_protos.py)."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
