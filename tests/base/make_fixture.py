#!/usr/bin/env python3
"""Writes tests/base/scalars.tfevents with TensorBoard's own code (its Event and Summary protos
and its record writer): the bytes test_tfevents.c expects am's writer to produce for the same
events. Run in a virtual environment with the tensorboard package:
    python3 -m venv /tmp/tb && /tmp/tb/bin/pip install tensorboard
    /tmp/tb/bin/python tests/base/make_fixture.py tests/base/scalars.tfevents
"""
import sys

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.record_writer import RecordWriter

# the events of test_tfevents.c's test_fixture: keep the two in step
EVENTS = [
    (1700000000.25, 0, None),
    (1700000001.5, 1, [("train/loss", 5.5451774), ("train/lr", 3.0e-3)]),
    (1700000002.75, 2, [("train/loss", 4.25), ("train/grad_norm", 1.0e-7), ("train/tokens_per_s", 123456.0), ("train/aux_loss", 0.0)]),
    (1700000003.0, 300, [("a/" + "x" * 200, -2.5)]),
]

with open(sys.argv[1], "wb") as f:
    w = RecordWriter(f)
    for wall, step, values in EVENTS:
        if values is None:
            e = Event(wall_time=wall, step=step, file_version="brain.Event:2")
        else:
            e = Event(wall_time=wall, step=step,
                      summary=Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in values]))
        w.write(e.SerializeToString())
    w.flush()
