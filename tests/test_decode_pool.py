"""The decode pool's fair turns: requests take turns task by task, each bounded as a whole (its place in the
pool's bound, its tasks' time together)."""
import time

import pytest

from glmvit.cli.decode_pool import DecodeBusy, DecodeClosed, DecodePool, DecodeTimeout

pytestmark = pytest.mark.timeout(300)


def nap(name, seconds):
    """A task that takes ``seconds``: its name and when it finished."""
    time.sleep(seconds)
    return name, time.monotonic()


def started(workers, max_waiting, timeout_s):
    pool = DecodePool(workers, max_waiting, timeout_s).start()
    deadline = time.monotonic() + 120
    while pool.ready < workers:
        assert time.monotonic() < deadline, "the decode workers did not start"
        time.sleep(0.01)
    return pool


def test_a_one_task_request_is_answered_before_two_earlier_heavy_requests_finish():
    """One worker, two requests of four 0.4 s tasks each queued first, then a request of one task: it waits for a
    task or two of theirs, not for all eight (first-in, first-out, it would finish last)."""
    pool = started(1, 8, 60.0)
    try:
        heavy = []
        for name in ("a", "b"):
            with pool.request() as turns:
                heavy.append([turns.submit(nap, name, 0.4) for _ in range(4)])
        small = pool.submit(nap, "small", 0.0)
        done = small.result(60)[1]
        ends = [max(f.result(60)[1] for f in tasks) for tasks in heavy]
    finally:
        pool.close(30)
    assert done < min(ends) - 0.5, (done, ends)  # at least one 0.4 s task of each heavy request still to run
    assert pool.busy == 0


def test_a_request_holds_one_place_in_the_bound_however_many_tasks_it_has():
    """The bound counts requests: one open request of three tasks holds one place; a second is refused at once
    past workers + max_waiting; a closed request gives its place back once its tasks are done."""
    pool = started(1, 0, 60.0)
    try:
        turns = pool.request()
        futures = [turns.submit(nap, "a", 0.05) for _ in range(3)]
        assert pool.busy == 1
        with pytest.raises(DecodeBusy, match="hold 1 requests"):
            pool.submit(nap, "b", 0.0)
        turns.close()
        with pytest.raises(DecodeClosed):
            turns.submit(nap, "a", 0.0)
        [f.result(60) for f in futures]
        deadline = time.monotonic() + 30
        while pool.busy:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert pool.submit(nap, "b", 0.0).result(60)[0] == "b"
    finally:
        pool.close(30)
    with pytest.raises(DecodeClosed):
        pool.request()


def test_a_requests_tasks_share_its_timeout():
    """timeout_s bounds a request's tasks together: each of three 1.5 s tasks fits 4 s, the third passes it and
    fails (its worker replaced); another request gets its own 4 s. Two tasks leave a second to spare, for a loaded
    machine's process hand-offs."""
    pool = started(1, 4, 4.0)
    try:
        with pool.request() as turns:
            futures = [turns.submit(nap, "a", 1.5) for _ in range(3)]
        assert [f.result(60)[0] for f in futures[:2]] == ["a", "a"]
        with pytest.raises(DecodeTimeout, match="more than 4 s"):
            futures[2].result(60)
        assert pool.submit(nap, "b", 1.5).result(60)[0] == "b"
        assert pool.timeouts == 1 and pool.replaced == 1
    finally:
        pool.close(30)


def test_a_worker_whose_server_is_gone_ends_quietly(tmp_path, capfd):
    """A worker that finds its pipe closed (the server was killed, by a second SIGTERM say, while the worker
    started) ends with status 0 and prints nothing: it printed a BrokenPipeError traceback into the server's log."""
    import multiprocessing

    from glmvit.cli.decode_pool import worker_main

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    worker = context.Process(target=worker_main, args=(theirs, (), str(tmp_path)), daemon=True)
    worker.start()
    theirs.close()
    ours.close()  # the server is gone before the worker says it is ready
    worker.join(120)
    assert worker.exitcode == 0 and "Traceback" not in capfd.readouterr().err
    assert not tmp_path.exists()  # its scratch directory: nobody else is left to remove it


def threads_here():
    """What decoding in this process runs on: FFmpeg's frame threads on or off, torch's intra-op threads."""
    import torch

    from glmvit import video

    return video.frame_threads, torch.get_num_threads()


def test_a_worker_decodes_on_one_thread_its_parallelism_being_the_pool():
    """A worker decodes a video without FFmpeg's frame threads and computes on one torch thread: the pool's workers
    are its parallelism, and threads on top of them cost throughput once every CPU is busy."""
    pool = DecodePool(1, 1, 60.0, ("glmvit.video",)).start()
    try:
        assert pool.submit(threads_here).result(120) == (False, 1)
    finally:
        pool.close(30)
    from glmvit import video

    assert video.frame_threads  # this process, no worker: a video decodes as fast as it can alone


def test_a_worker_runs_its_modules_warm_up_before_it_says_it_is_ready():
    """Each preloaded module's ``warm_worker()`` runs once in the worker before its first task (first-use costs kept
    out of a request's time); one that fails leaves the worker serving (a task meets the failure and answers it)."""
    from tests.decode_warm_probe import warmed, warmed_on_one_thread

    pool = DecodePool(1, 1, 60.0, ("tests.decode_warm_broken", "tests.decode_warm_probe")).start()
    try:
        assert pool.submit(warmed).result(120) is True
        assert pool.submit(warmed_on_one_thread).result(60) is True  # it warms what a task runs
        assert pool.submit(nap, "after", 0.0).result(60)[0] == "after"
    finally:
        pool.close(30)


def test_the_servers_warm_up_decodes_a_picture_and_a_clip():
    from glmvit.cli.serve_media import warm_worker

    warm_worker()  # raises if the decode stack cannot read what it made
