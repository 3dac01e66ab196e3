// drizzle-kit generates drizzle/ from src/db/schema.ts, whose tables are written in the schema
// "outboxd"; `outboxd migrate` applies them to OUTBOXD_SCHEMA (src/db/migrate.ts), and only it should
// apply them. What drizzle-kit reads from a database (push, pull, studio) follows OUTBOXD_SCHEMA here.
import { defineConfig } from 'drizzle-kit';
import { loadConfig } from './src/runtime/config.ts';

const { schema, databaseUrl } = loadConfig();

export default defineConfig({
  dialect: 'postgresql',
  schema: './src/db/schema.ts',
  out: './drizzle',
  schemaFilter: [schema],
  migrations: { schema, table: '__drizzle_migrations' },
  ...(databaseUrl ? { dbCredentials: { url: databaseUrl } } : {}),
});
