//! Place claims (`model::PlaceClaim`) as both engines store them: a row
//! per claim with its figures as JSON, read together with the nodes'
//! published figures in one statement, so a heartbeat that swaps claims
//! for figures is seen wholly before or wholly after.

use crate::model::TeamUsage;

/// Sums what the read's rows hold: each a team's figures on one node or
/// one claim, as JSON (`None`: a node that published none for the team).
pub(super) fn total(rows: impl IntoIterator<Item = Option<String>>) -> anyhow::Result<TeamUsage> {
    let mut sum = TeamUsage::default();
    for row in rows.into_iter().flatten() {
        sum += serde_json::from_str::<TeamUsage>(&row)?;
    }
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_without_figures_add_nothing() {
        let rows = [Some(r#"{"running":1,"paused":0,"snapshots":2,"disk_bytes":5}"#.to_string()), None];
        let twice = rows.iter().cloned().chain(rows.iter().cloned());
        assert_eq!(total(twice).unwrap(), TeamUsage { running: 2, paused: 0, snapshots: 4, disk_bytes: 10 });
        assert!(total([Some("{".to_string())]).is_err());
    }
}
