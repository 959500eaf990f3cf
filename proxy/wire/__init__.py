"""Wire forms: the KServe v2 codecs (gRPC protobuf, HTTP JSON and the binary extension), the
OpenAI JSON parts, image decoding and media URLs. Pure translation between bytes and ``Call`` /
``Result``: imports nothing of ``proxy`` but the SDK (call, tensor, errors, contract)."""
