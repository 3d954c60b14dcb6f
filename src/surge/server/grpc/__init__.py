"""KServe v2 / Open Inference Protocol over gRPC (inference.GRPCInferenceService)."""
