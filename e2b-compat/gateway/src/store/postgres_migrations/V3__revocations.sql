-- The cluster CA's revocation list as `copse tls revoke --database`
-- last published it (one row, id 'cluster'); nodes check its signature
-- and number before adopting it.
CREATE TABLE revocation_lists (
    id TEXT PRIMARY KEY,
    pem TEXT NOT NULL
);
