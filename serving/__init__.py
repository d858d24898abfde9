"""The serving layer: everything between a caller and one model replica's controller.

    serving.server        Server: the Python API (generate, generate_stream, generate_async,
                          submit, cancel, close): construction, calibration, a thin front
    serving.validation    argument checks and tokenization on the caller's thread;
                          TokensPrompt, and the single-or-batch rule of generate
    serving.loop          ServingLoop: the loop thread (inbox, schedule -> execute -> update,
                          failure containment)
    serving.outputs       RequestOutput (with n CompletionOutputs), RequestMetrics,
                          StreamDelta, RequestHandle, RequestStream, and the incremental
                          detokenizer that finds stop strings
    serving.grpc_service  GrpcServer: medha.v1.Medha (serving/proto) and grpc.health.v1.Health
    serving.http_server   the OpenAI-compatible HTTP API; serving.openai_logprobs its
                          logprobs objects
    serving.metrics       per-Server Prometheus metrics
    serving.prefill_pool  a CDSP prefill pool (seed 001) as a Server's prefill stage;
                          serving.pool_handoff moves its pages to a replica
    serving.replay        replays a request trace against a live Server
    serving.cli           the `medha-jax` command; serving.demo is `medha-jax demo`

Nothing is imported here, so `import serving.<module>` pays only for what it uses.
"""
