"""vgpud's lifecycle over a test policy: ``python -m tests.support.testdaemon``.

The real Daemon (vgpud.daemon: channel, filter, READY=1, drain) with a
stateless policy from tests.support.policies and no services around it, for
the tests and benchmarks of the interception path that need no quota:
``--policy allow | deny-class:0x40[,0x3f]`` and ``--filter SPEC`` (repeatable).
"""

from __future__ import annotations

import click

from tests.support.policies import parse_filter_spec, parse_policy
from vgpud.daemon import Daemon, configure_logging, run
from vgpud.kernel.channel import GenlChannel
from vgpud.policy.dispatch import Dispatcher


class NoServices:
    """Nothing around the upcall path (vgpud.daemon.Services)."""

    async def start(self) -> bool:
        return True

    async def attach(self, channel: GenlChannel) -> None:
        pass

    async def serve(self, dispatcher: Dispatcher, channel: GenlChannel) -> None:
        pass

    async def stop(self) -> None:
        pass

    def reload(self) -> None:
        pass

    def close(self) -> None:
        pass


@click.command()
@click.option("--policy", "policy_spec", default="allow", show_default=True,
              help="allow | deny-class:0x40[,0x3f]")
@click.option("--filter", "filter_specs", multiple=True, metavar="SPEC",
              help="Extra rules: open | alloc[+shadow]:CLASSES | control[+shadow]:CMDS.")
@click.option("--on-error", type=click.Choice(["deny", "allow"]), default="deny")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info")
@click.option("--no-probes", is_flag=True, hidden=True)  # what tests.support.vgpud_proc passes
@click.option("--no-fs", is_flag=True, hidden=True)
def main(policy_spec: str, filter_specs: tuple[str, ...], on_error: str, log_level: str,
         no_probes: bool, no_fs: bool) -> None:
    configure_logging(log_level)
    try:
        policy = parse_policy(policy_spec)
        filt = policy.filter()
        for spec in filter_specs:
            filt = filt + parse_filter_spec(spec)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    run(Daemon(Dispatcher(policy, fail_open=on_error == "allow"), filt, NoServices()))


if __name__ == "__main__":
    main()
