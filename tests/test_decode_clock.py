"""The decode clock: a thread's time decoding media, counted by the decoders themselves."""
import threading
import time

from glmvit import decode_clock


def test_counted_items_add_the_time_spent_producing_them_and_closing_closes_the_source():
    closed = []

    def slow():
        try:
            for k in range(3):
                time.sleep(0.02)
                yield k
        finally:
            closed.append(True)

    before = decode_clock.seconds()
    items = decode_clock.counted(slow())
    assert next(items) == 0
    time.sleep(0.2)  # the consumer's own time between items is not decoding
    assert next(items) == 1
    items.close()
    spent = decode_clock.seconds() - before
    assert closed == [True] and 0.04 <= spent < 0.2, spent


def test_each_thread_counts_its_own_decoding():
    seen = {}

    def other():
        with decode_clock.counting():
            time.sleep(0.03)
        seen["other"] = decode_clock.seconds()

    before = decode_clock.seconds()
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen["other"] >= 0.03 and decode_clock.seconds() == before
