//! `copse-rig-egress`: what the host's egress proxy adds to a sandbox's
//! HTTP(S) requests, and a volume's I/O beside the sandbox's own disk. It
//! drives Linux network namespaces directly, so it exists for Linux only;
//! see `copse_rigs::egress`.

fn main() -> anyhow::Result<()> {
    #[cfg(target_os = "linux")]
    {
        copse_rigs::egress::run()
    }
    #[cfg(not(target_os = "linux"))]
    {
        anyhow::bail!("copse-rig-egress measures the Linux network backend; there is no FreeBSD rig yet")
    }
}
