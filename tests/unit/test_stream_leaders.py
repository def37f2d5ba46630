"""Which server a stream's leader is handed to (haru/log/leaders.py), and `--stream-leaders`' parsing."""

from __future__ import annotations

import pytest

from haru.core.errors import ConfigError
from haru.log.leaders import Placement, leader_move, parse_servers

R = [("n1", True, False), ("n2", True, False), ("n3", True, False)]


def test_a_leader_on_the_first_wanted_server_stays():
    assert leader_move("n3", R, ["n3"]) == ""
    assert leader_move("", R, ["n3"]) == ""  # no leader (an election under way): nothing to hand over
    assert leader_move("n1", R, []) == ""  # nothing wanted


def test_it_goes_to_the_first_wanted_server_that_can_lead():
    assert leader_move("n1", R, ["n3", "n2"]) == "n3"
    assert leader_move("n2", R, ["n3", "n2"]) == "n3"  # on a wanted server, but not the first that can lead
    lagging = [("n2", True, False), ("n3", False, False)]
    assert leader_move("n1", lagging, ["n3", "n2"]) == "n2"
    assert leader_move("n2", lagging, ["n3", "n2"]) == ""  # n3 not caught up: n2 is the best there is
    assert leader_move("n1", [("n2", True, False), ("n3", True, True)], ["n3", "n2"]) == "n2"  # n3 offline
    assert leader_move("n1", [("n2", True, False), ("n3", False, False)], ["n3"]) == ""  # wait for n3
    assert leader_move("n1", R, ["n9"]) == ""  # not a replica: nothing to ask


def test_servers_beside_domains_come_first_while_the_domain_is_a_fleets_first_standby():
    p = parse_servers(" a=n1, b=n2 ,n3,,")
    assert p == Placement({"a": "n1", "b": "n2"}, ["n3"])
    assert p.wanted(["b"]) == ["n2", "n3"]  # a active, b its standby: beside b, else the tie-breaker
    assert p.wanted(["a"]) == ["n1", "n3"]  # after the failover the leaders follow the new standby
    assert p.wanted([]) == ["n3"]  # no standby fit (its region lost): the tie-breaker
    assert p.wanted(["c", "b", "b"]) == ["n2", "n3"]  # a domain with no server named counts for nothing
    assert parse_servers("") == Placement({}, [])


@pytest.mark.parametrize("raw", ["=n2", "b=", "b = "])
def test_a_malformed_entry_is_refused_with_the_form(raw):
    with pytest.raises(ConfigError, match="domain=server"):
        parse_servers(raw)
