-- What verbs in flight on each node hold for a team until that node's
-- heartbeat publishes figures including them (model::PlaceClaim); the
-- figures are JSON, as in the nodes' records.
CREATE TABLE place_claims (
    id TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    team TEXT NOT NULL,
    usage TEXT NOT NULL,
    at_ms BIGINT NOT NULL
);
CREATE INDEX place_claims_team ON place_claims (team);
