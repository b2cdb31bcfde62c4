//! `copse-rig-net`: the sandbox network's cost — RTT and throughput to a
//! peer through the policy path, attach cost, policy update latency. It
//! drives Linux network namespaces and nftables directly, so it exists for
//! Linux only; see `rig.rs`.

#[cfg(target_os = "linux")]
mod rig;

fn main() -> anyhow::Result<()> {
    #[cfg(target_os = "linux")]
    {
        rig::main()
    }
    #[cfg(not(target_os = "linux"))]
    {
        anyhow::bail!("copse-rig-net measures the Linux network backend; there is no FreeBSD rig yet")
    }
}
