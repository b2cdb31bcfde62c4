-- The nodes sharing this database (model/node.rs), one JSON record each;
-- a node rewrites its own row at every heartbeat.
CREATE TABLE nodes (
    id TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
