"""The pipeline schedules by name: for each, the ``torch.distributed.pipelining`` schedule
class that runs it and the number of stages each process holds."""

SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
    "zero-bubble": ("ScheduleInterleavedZeroBubble", 2),
}
