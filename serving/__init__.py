"""The serving layer: everything between a caller and one model replica's controller.

    serving.server        Server: the Python API (generate, generate_stream, generate_async,
                          submit, cancel, close): construction, calibration, a thin front
    serving.validation    argument checks and tokenization on the caller's thread;
                          TokensPrompt, and the single-or-batch rule of generate
    serving.loop          ServingLoop: the loop thread (inbox, schedule -> execute -> update,
                          failure containment)
    serving.outputs       RequestOutput, RequestMetrics, StreamDelta, RequestHandle,
                          RequestStream, and the incremental detokenizer that finds stop strings
    serving.grpc_service  GrpcServer: medha.v1.Medha and grpc.health.v1.Health (serving/proto)
    serving.metrics       per-Server Prometheus metrics
    serving.replay        replays a request trace against a live Server
    serving.cli           the `medha-jax` command; serving.demo is `medha-jax demo`

Nothing is imported here, so `import serving.<module>` pays only for what it uses.
"""
