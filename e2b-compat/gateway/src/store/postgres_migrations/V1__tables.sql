-- The tables of store/sqlite.rs, in PostgreSQL's types: each record is
-- its JSON text (TEXT, not JSONB, so a row that no longer parses can be
-- read back whole and quarantined), beside the columns it is found by.
CREATE TABLE sandboxes (
    id TEXT PRIMARY KEY,
    end_at_ms BIGINT NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX sandboxes_end_at ON sandboxes (end_at_ms);
CREATE TABLE quarantine (
    kind TEXT NOT NULL,
    id TEXT NOT NULL,
    record TEXT NOT NULL,
    reason TEXT NOT NULL,
    at_ms BIGINT NOT NULL
);
CREATE TABLE team_secrets (
    id TEXT PRIMARY KEY,
    team TEXT NOT NULL,
    name TEXT NOT NULL,
    record TEXT NOT NULL,
    UNIQUE (team, name)
);
CREATE TABLE team_volumes (
    id TEXT PRIMARY KEY,
    team TEXT NOT NULL,
    name TEXT NOT NULL,
    record TEXT NOT NULL,
    UNIQUE (team, name)
);
CREATE TABLE team_snapshots (
    team TEXT NOT NULL,
    id TEXT NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (team, id)
);
CREATE TABLE built_templates (
    id TEXT PRIMARY KEY,
    team TEXT NOT NULL,
    name TEXT NOT NULL,
    record TEXT NOT NULL,
    UNIQUE (team, name)
);
CREATE TABLE build_layers (
    id TEXT PRIMARY KEY,
    team TEXT NOT NULL,
    record TEXT NOT NULL
);
CREATE TABLE template_labels (
    id TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE teams (
    name TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE keys (
    hash TEXT PRIMARY KEY,
    prefix TEXT NOT NULL,
    record TEXT NOT NULL
);
CREATE TABLE journal (
    id TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE generations (
    name TEXT PRIMARY KEY,
    value BIGINT NOT NULL
);
