//! The tables both databases hold, by the names both give them.

/// The one row of `revocation_lists`: the cluster has one CA.
pub(super) const REVOCATION_LIST: &str = "cluster";

/// The tables whose rows are one JSON record each.
#[derive(Clone, Copy)]
pub(super) enum Table {
    Sandboxes,
    Secrets,
    Journal,
    Volumes,
    Templates,
    BuildLayers,
    TemplateLabels,
    Nodes,
}

impl Table {
    pub(super) fn name(self) -> &'static str {
        match self {
            Table::Sandboxes => "sandboxes",
            Table::Secrets => "team_secrets",
            Table::Journal => "journal",
            Table::Volumes => "team_volumes",
            Table::Templates => "built_templates",
            Table::BuildLayers => "build_layers",
            Table::TemplateLabels => "template_labels",
            Table::Nodes => "nodes",
        }
    }
}
