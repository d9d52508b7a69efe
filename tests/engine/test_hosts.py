"""engine/serving/hosts.py: the Host and Origin rules that the engine and `mgr` share."""

from __future__ import annotations

import pytest

from moelab.engine.serving.hosts import ServedHosts, is_foreign, split_host

# documentation addresses (RFC 5737, RFC 3849): on no interface of any machine
ARRIVED_ON = ("192.0.2.44", "::ffff:192.0.2.44", "2001:db8::5")


@pytest.mark.parametrize("bind", ["0.0.0.0", "127.0.0.1"])
def test_a_host_naming_the_address_the_request_arrived_on_is_served(bind):
    hosts = ServedHosts(bind)
    assert hosts.serves("192.0.2.44:8000", "192.0.2.44")
    assert hosts.serves("192.0.2.44", "::ffff:192.0.2.44")  # a dual-stack socket's view
    assert hosts.serves("[2001:db8::5]:8000", "2001:db8::5")
    # another address, or none known, is not; nor is a name, whatever the socket says
    assert not hosts.serves("192.0.2.45:8000", "192.0.2.44")
    assert not hosts.serves("192.0.2.44:8000", None)
    assert not hosts.serves("evil.example:8000", "evil.example")
    assert hosts.serves("localhost:8000", "192.0.2.44")


def test_extra_names_and_the_bound_address_are_served():
    hosts = ServedHosts("192.0.2.9", ["llm.lan", "GPU-box.example."])
    assert hosts.serves("192.0.2.9:8000") and hosts.serves("llm.lan:8000")
    assert hosts.serves("gpu-box.example") and hosts.serves("[::1]:8000")
    assert not hosts.serves("llm.lan.evil.example") and not hosts.serves("")


@pytest.mark.parametrize(
    ("headers", "foreign"),
    [
        ({}, False),  # no browser: curl, the OpenAI clients, mgr
        ({"origin": "http://127.0.0.1:8000"}, False),
        ({"origin": "http://127.0.0.1:8000", "sec-fetch-site": "same-origin"}, False),
        ({"origin": "http://evil.example"}, True),
        ({"origin": "http://127.0.0.1:9000"}, True),  # another port is another origin
        ({"origin": "null"}, True),
        ({"sec-fetch-site": "cross-site"}, True),
        ({"sec-fetch-site": "same-site"}, True),
        ({"sec-fetch-site": "none"}, False),  # typed into the address bar
    ],
)
def test_a_request_from_another_sites_page_is_foreign(headers, foreign):
    assert is_foreign(headers, "127.0.0.1:8000") is foreign


def test_split_host_reads_names_addresses_and_ports():
    assert split_host("[::1]:8000") == ("::1", 8000)
    assert split_host("Example.COM.") == ("example.com", None)
    assert split_host("host:port") == ("", None)
