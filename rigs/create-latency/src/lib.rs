//! Pure pieces of the create-latency rig: the anchors measured beside
//! copse. The envd wire protocol is `copse-protocol`'s; statistics and
//! Server-Timing parsing are shared with the other rigs in
//! `copse-rig-common`; everything that touches the network, processes or the
//! clock lives in `main.rs`.

pub mod anchors;
