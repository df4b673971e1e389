"""Picker mode: taogate as the endpoint picker of a Kubernetes inference gateway (or any Envoy).

The gateway in front (Envoy, Istio, NGINX Gateway Fabric, agentgateway, kgateway) carries the bytes;
for each request it asks taogate over Envoy's external-processing gRPC stream where to send it. The
answer comes from the same gateway parts ``serve`` builds (fleet, dispatcher, policy, learner,
leases), and the response flowing back through the stream feeds the same learning::

    encoding   protobuf answers: the pick, immediate errors, body chunks, header mutations
    names      the header names and metadata keys read (the Inference Extension's, llm-d's) and written
    hints      subset hints and the served endpoint, from the gateway's metadata
    objective  an InferenceObjective's name → a priority class (``[picker] objectives``)
    rewrite    a route's model rewrite, written into the body
    admit      one request's headers and body → key check, intake, plan, lease
    tap        the response as it passes: TTFT, usage, the end, an abort → learner and lease
    servicer   the ext_proc stream, message by message
    server     ``taogate pick``: the gRPC server, its health service, the HTTP side
"""
