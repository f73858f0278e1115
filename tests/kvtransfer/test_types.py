import pickle

from kvtransfer.types import State, Ticket


def test_ticket_is_picklable():
    ticket = Ticket("t1", "r1", "grpc://127.0.0.1:5", [7, 3, 9], 1.5e9, "grpc")
    assert pickle.loads(pickle.dumps(ticket)) == ticket


def test_finished_is_a_comparison():
    assert not State.TRANSFERRING.is_finished
    assert State.DONE.is_finished and State.FAILED.is_finished
