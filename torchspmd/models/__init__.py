"""Models free of distributed code, used by the examples, tests and the train job."""

from torchspmd.models.decoder import DecoderLayer, DecoderModel, RMSNorm

__all__ = ["DecoderModel", "DecoderLayer", "RMSNorm"]
