"""The gRPC front end of a Server: medha.v1.Medha (Generate, Metrics) and grpc.health.v1.Health
(the `grpcio-health-checking` package's servicer).

    grpc_server = GrpcServer(server, port=50051, token="s3cret")   # serving now
    grpc_server.wait()                                              # until stop()

One worker thread per open call (grpc's synchronous server): a Generate call blocks its
thread reading the request's deltas, which costs nothing while it waits. Calls beyond
`max_concurrent_rpcs` are refused at once with RESOURCE_EXHAUSTED rather than queued
without an answer. Whatever ends a call (the client cancels, its deadline passes, the
connection drops, the server stops) cancels the request, so its KV pages return to the pool.

The client's request_id is a label echoed in the responses; the server names each request
itself, so labels may repeat and cancelling one call never reaches another.

Bad input (bytes that do not parse included, an SLO or priority outside the server's
RequestLimits) fails the call with INVALID_ARGUMENT, a prompt that can never fit the KV
cache with RESOURCE_EXHAUSTED, a priority more important than the default without a
priority token (serving.auth) with PERMISSION_DENIED, each with a message naming the field.
Messages over `max_message_bytes` (default 4 MiB) are refused by grpc: RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from medha_jax.request import SLO, TokenLogprobs
from medha_jax.sampling_params import SamplingParams
from medha_jax.scheduler.controller import CapacityError
from serving.outputs import StreamDelta
from serving.auth import Access
from serving.proto import medha_pb2, medha_pb2_grpc
from serving.server import Server
from serving.validation import PriorityNotAllowed

SERVICE_NAME = "medha.v1.Medha"
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
# A 128k-token prompt is ~400 KiB of varints; grpc's own default. More only costs the
# server memory a client chooses.
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20


def request_from_proto(msg: medha_pb2.GenerateRequest
                       ) -> tuple[str | list[int], SamplingParams, SLO | None]:
    """The prompt, SamplingParams and SLO a GenerateRequest asks for (ValueError if bad)."""
    which = msg.WhichOneof("prompt")
    if which is None:
        raise ValueError("prompt: set either text or token_ids")
    prompt = msg.text if which == "text" else list(msg.token_ids.ids)
    fields = {}
    for name in ("temperature", "top_k", "top_p", "max_tokens", "seed", "n", "logprobs",
                 "prompt_logprobs"):
        if msg.sampling.HasField(name):
            fields[name] = getattr(msg.sampling, name)
    params = SamplingParams(**fields, stop=tuple(msg.sampling.stop),
                            stop_token_ids=tuple(msg.sampling.stop_token_ids),
                            ignore_eos=msg.sampling.ignore_eos)
    slo = SLO(ttft_s=msg.slo.ttft_s, tpot_s=msg.slo.tpot_s) if msg.HasField("slo") else None
    return prompt, params, slo


def _logprobs_proto(entry: TokenLogprobs) -> medha_pb2.TokenLogprobs:
    return medha_pb2.TokenLogprobs(
        token_id=entry.token_id, logprob=entry.logprob,
        top=[medha_pb2.TokenLogprobs.Alternative(token_id=t, logprob=lp) for t, lp in entry.top])


def response_from_delta(delta: StreamDelta) -> medha_pb2.GenerateResponse:
    response = medha_pb2.GenerateResponse(
        request_id=delta.request_id, token_ids=delta.token_ids, text=delta.text,
        finished=delta.finished, finish_reason=delta.finish_reason or "",
        error=delta.error or "", index=delta.index,
        logprobs=[_logprobs_proto(e) for e in delta.logprobs or ()],
        # The first prompt token has no logprobs (None): the message holds tokens 1.. on.
        prompt_logprobs=[_logprobs_proto(e) for e in (delta.prompt_logprobs or ())[1:]])
    if delta.metrics is not None:
        m = delta.metrics
        response.metrics.CopyFrom(medha_pb2.RequestMetrics(
            ttft_s=m.ttft, tpot_s=m.tpot, queue_time_s=m.queue_time,
            num_prompt_tokens=m.num_prompt_tokens, num_output_tokens=m.num_output_tokens,
            num_preemptions=m.num_preemptions, num_cached_tokens=m.num_cached_tokens,
            replica=m.replica))
    return response


class MalformedRequest:
    """What the Generate deserializer gives for bytes that are no GenerateRequest."""

    def __init__(self, error: str):
        self.error = error


def parse_generate_request(data: bytes) -> medha_pb2.GenerateRequest | MalformedRequest:
    """Never raises: grpc would answer a deserializer's exception with INTERNAL, but bad
    bytes (invalid UTF-8 in a string, truncation, garbage) are the client's error."""
    try:
        return medha_pb2.GenerateRequest.FromString(data)
    except Exception as e:         # noqa: BLE001 - protobuf's DecodeError and friends
        return MalformedRequest(f"malformed GenerateRequest: {e}")


class MedhaServicer(medha_pb2_grpc.MedhaServicer):
    def __init__(self, server: Server, access: Access = Access()):
        self._server = server
        self._access = access

    def Generate(self, request, context):
        if isinstance(request, MalformedRequest):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        try:
            authorization = dict(context.invocation_metadata()).get("authorization", "")
            self._server.limits.check_priority(
                request.priority, may_raise=self._access.may_raise_priority(authorization))
            prompt, params, slo = request_from_proto(request)
            handle = self._server.submit(prompt, params, slo=slo, priority=request.priority,
                                         request_id=request.request_id or None,
                                         session_id=request.session_id or None)
        except CapacityError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except PriorityNotAllowed as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except (ValueError, TypeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RuntimeError as e:        # the server is closing, or no replica is healthy
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        # Whatever order the events come in, a call that ends early frees the request:
        # the callback runs when the call ends (cancel, deadline, disconnect); when the
        # call had already ended before it was added (add_callback returns False, and it
        # never runs) the request is cancelled here; and a stream closed on this thread
        # cancels in `finally`. handle.cancel names the server's own id of this request,
        # so a late callback never reaches a newer request reusing the client's label.
        try:
            if not context.add_callback(handle.cancel):
                handle.cancel()
            for delta in handle:
                if delta.unavailable:         # its replica failed and none could take over
                    context.abort(grpc.StatusCode.UNAVAILABLE, delta.error)
                yield response_from_delta(delta)
        finally:
            if not handle.finished:
                handle.cancel()

    def Metrics(self, request, context):
        return medha_pb2.MetricsResponse(text=self._server.metrics_text())


class _BearerToken(grpc.ServerInterceptor):
    """Refuses calls without metadata "authorization: Bearer <token>" (or a priority token;
    health probes exempt)."""

    def __init__(self, access: Access):
        self._access = access

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata).get("authorization", "")
        if self._access.admits(given):
            return continuation(handler_call_details)
        return self._deny


class _ServerHealth(health.HealthServicer):
    """The standard health service, answering NOT_SERVING for every service once the server
    cannot serve at all (Server.unavailable: a multi-host replica that lost a process), so
    a gateway routes away from it."""

    def __init__(self, server):
        super().__init__()
        self._server = server

    def Check(self, request, context):
        if getattr(self._server, "unavailable", None) is not None:
            return health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return super().Check(request, context)


class GrpcServer:
    """Serves a Server over gRPC on host:port (port 0 picks a free one: see `.port`)."""

    def __init__(self, server: Server, *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, max_concurrent_rpcs: int = 64,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 priority_tokens: tuple[str, ...] = ()):
        """priority_tokens: bearer tokens whose clients may ask for a priority more
        important than the default (see serving.auth); they also admit a client."""
        if max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {max_concurrent_rpcs}")
        if token is not None and not token:
            raise ValueError("token must be a non-empty string or None")
        access = Access.of(token, priority_tokens)
        self.server = server
        # The standard health protocol: "" (the whole server) and "medha.v1.Medha".
        self.health = _ServerHealth(server)
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_concurrent_rpcs,
                                       thread_name_prefix="medha-grpc"),
            interceptors=[_BearerToken(access)] if token else [],
            maximum_concurrent_rpcs=max_concurrent_rpcs,
            options=[("grpc.max_receive_message_length", max_message_bytes),
                     ("grpc.max_send_message_length", max_message_bytes),
                     ("grpc.so_reuseport", 0)])
        servicer = MedhaServicer(server, access)
        self._grpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                servicer.Generate, request_deserializer=parse_generate_request,
                response_serializer=medha_pb2.GenerateResponse.SerializeToString),
            "Metrics": grpc.unary_unary_rpc_method_handler(
                servicer.Metrics, request_deserializer=medha_pb2.MetricsRequest.FromString,
                response_serializer=medha_pb2.MetricsResponse.SerializeToString),
        }),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        self.host = host
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = self._grpc.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind the gRPC server to {address}")
        self._grpc.start()

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def stop(self, grace: float | None = 5.0) -> None:
        """Reports NOT_SERVING, then stops; open calls get `grace` seconds to finish."""
        self.health.enter_graceful_shutdown()
        self._grpc.stop(grace).wait()

    def wait(self, timeout: float | None = None) -> bool:
        return self._grpc.wait_for_termination(timeout)

    def __enter__(self) -> "GrpcServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
