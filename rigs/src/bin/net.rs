//! `copse-rig-net`: the sandbox network's cost — RTT and throughput to a
//! peer through the policy path, attach cost, policy update latency. It
//! drives Linux network namespaces and nftables directly, so it exists for
//! Linux only; see `copse_rigs::net`.

fn main() -> anyhow::Result<()> {
    #[cfg(target_os = "linux")]
    {
        copse_rigs::net::run()
    }
    #[cfg(not(target_os = "linux"))]
    {
        anyhow::bail!("copse-rig-net measures the Linux network backend; there is no FreeBSD rig yet")
    }
}
