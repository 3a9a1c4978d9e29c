"""Event loops for the daemon and its clients: the io_uring loop and the choice between loops.

`uring` wraps the Cython loop (mooncaked._native.UringLoop); `loops.choose_loop` picks it or
stdlib asyncio's.
"""
