// deploy/ kept honest without a Docker engine: every manifest parses and validates against the
// Kubernetes schemas, and what it names (probe paths, port, env vars, CLI commands) is what the code
// serves and reads.
import { execFileSync } from 'node:child_process';
import { readdirSync, readFileSync, statSync } from 'node:fs';
import path from 'node:path';
import { parseEnv } from 'node:util';
import { Namespace, ConfigMap, Service } from 'kubernetes-models/v1';
import { Deployment } from 'kubernetes-models/apps/v1';
import { Job } from 'kubernetes-models/batch/v1';
import { PodDisruptionBudget } from 'kubernetes-models/policy/v1';
import { HorizontalPodAutoscaler } from 'kubernetes-models/autoscaling/v2';
import { Ingress } from 'kubernetes-models/networking.k8s.io/v1';
import { Ajv2020 } from 'ajv/dist/2020.js';
import { parse, parseAllDocuments } from 'yaml';
import { describe, expect, it } from 'vitest';
import { envSchema, loadConfig } from '../../src/runtime/config.ts';
import { PROBES } from '../../src/runtime/worker.ts';
import { webhookRoutes } from '../../src/http/webhooks.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { DEPLOYED_ENV, DEPLOYED_NODE_ARGS, DEPLOYED_NODE_OPTIONS } from '../../harness/world.ts';
import { RUN_AS_USER, WORKER_TMP } from '../support/hardening.ts';

const ROOT = path.resolve(import.meta.dirname, '../..');
const read = (p: string) => readFileSync(path.join(ROOT, p), 'utf8');
const walk = (dir: string): string[] =>
  readdirSync(path.join(ROOT, dir)).flatMap((f) => {
    const p = path.join(dir, f);
    return statSync(path.join(ROOT, p)).isDirectory() ? walk(p) : [p];
  });
const yamlFiles = walk('deploy').filter((f) => /\.ya?ml$/.test(f));
type Doc = Record<string, any>;
const docs = (file: string): Doc[] =>
  parseAllDocuments(read(file)).map((d) => {
    if (d.errors.length) throw new Error(`${file}: ${d.errors[0]!.message}`);
    return d.toJS() as Doc;
  });
const k8s = walk('deploy/k8s/base').filter((f) => f.endsWith('.yaml') && !f.endsWith('kustomization.yaml')).flatMap(docs);
const byKind = (kind: string) => k8s.filter((d) => d.kind === kind);
const deployment = byKind('Deployment')[0]!;
const worker = deployment.spec.template.spec.containers[0];
const job = byKind('Job')[0]!;
const compose = docs('deploy/compose.yaml')[0]!;
const CONFIG_KEYS = Object.keys(envSchema.shape);
/** NODE_OPTIONS is Node's own and MALLOC_ARENA_MAX glibc's; everything else the app reads is in the config schema. */
const NODE_KEYS = ['NODE_OPTIONS', 'NODE_ENV', ...Object.keys(DEPLOYED_ENV)];
const DEFAULT_PORT = loadConfig({}).worker.httpPort;

describe('deploy manifests', () => {
  it('every YAML file under deploy/ parses', () => {
    expect(yamlFiles.length).toBeGreaterThanOrEqual(10);
    for (const f of yamlFiles) expect(() => docs(f), f).not.toThrow();
  });

  it('validates against the Kubernetes schemas', () => {
    const models: Record<string, new (d: any) => { validate(): void }> = {
      Namespace, ConfigMap, Service, Deployment, Job, PodDisruptionBudget, HorizontalPodAutoscaler,
    };
    for (const d of k8s) {
      const Model = models[d.kind];
      expect(Model, `a schema for ${d.kind}`).toBeDefined();
      expect(() => new Model!(d).validate(), `${d.kind} ${d.metadata?.name}`).not.toThrow();
    }
    expect(() => new Deployment({ ...deployment, spec: { ...deployment.spec, replicas: 'three' } }).validate()).toThrow();
  });

  it('the kustomization lists every base manifest', () => {
    const listed = docs('deploy/k8s/base/kustomization.yaml')[0]!.resources as string[];
    const files = readdirSync(path.join(ROOT, 'deploy/k8s/base')).filter((f) => f !== 'kustomization.yaml');
    expect(new Set(listed)).toEqual(new Set(files));
  });

  it('probes, port and metrics annotations are the ones the worker serves', () => {
    const configMap = byKind('ConfigMap')[0]!.data;
    const port = Number(configMap.HTTP_PORT ?? DEFAULT_PORT);
    expect(worker.ports).toEqual([
      { name: 'http', containerPort: port },
      { name: 'admin', containerPort: Number(configMap.ADMIN_HTTP_PORT) },
    ]);
    expect(worker.readinessProbe.httpGet.path).toBe(PROBES.readiness);
    expect(worker.livenessProbe.httpGet.path).toBe(PROBES.liveness);
    const annotations = deployment.spec.template.metadata.annotations;
    expect(annotations['prometheus.io/path']).toBe(PROBES.metrics);
    expect(Number(annotations['prometheus.io/port'])).toBe(port);
    expect(read('deploy/Dockerfile')).toContain(PROBES.liveness);
    expect(byKind('Service')[0]!.spec.type).toBe('ClusterIP');
  });

  it('the admin API listens apart, and the ingress routes only POST /webhooks/stripe to the worker port', () => {
    const config = loadConfig({ ...byKind('ConfigMap')[0]!.data, ADMIN_TOKEN: 'x'.repeat(32) });
    const ports = Object.fromEntries(worker.ports.map((p: { name: string; containerPort: number }) => [p.name, p.containerPort]));
    expect(ports).toEqual({ http: config.worker.httpPort, admin: config.admin.httpPort });
    // Bound on every interface, or the outboxd-admin Service could not reach it.
    expect(config.admin.httpHost).toBe('0.0.0.0');
    const service = (name: string) => byKind('Service').find((d) => d.metadata.name === name)!.spec;
    expect(service('outboxd-worker').ports.map((p: { targetPort: string }) => p.targetPort)).toEqual(['http']);
    expect(service('outboxd-admin').ports.map((p: { targetPort: string }) => p.targetPort)).toEqual(['admin']);
    expect(service('outboxd-admin').type).toBe('ClusterIP');

    const overlay = docs('deploy/k8s/overlays/example/kustomization.yaml')[0]!;
    expect(overlay.resources).toContain('ingress.yaml');
    const ingress = docs('deploy/k8s/overlays/example/ingress.yaml')[0]!;
    expect(() => new Ingress(ingress as never).validate()).not.toThrow();
    const routes = webhookRoutes({ pool: undefined as never, gateway: undefined as never, log: createLogger('silent'), secrets: ['whsec_x'] });
    expect(routes.map(([method, p]) => `${method} ${p}`)).toEqual(['POST /webhooks/stripe']);
    const webhookPath = routes[0]![1];
    const paths = ingress.spec.rules.flatMap((r: Doc) => r.http.paths);
    expect(paths).toEqual([{ path: webhookPath, pathType: 'Exact', backend: { service: { name: 'outboxd-worker', port: { name: 'http' } } } }]);
  });

  it('deploy/.env.example loads as copied: an empty value is unset', () => {
    const example = parseEnv(read('deploy/.env.example'));
    expect(Object.values(example)).toContain('');
    const config = loadConfig(example);
    expect(config.stripe).toMatchObject({ secretKey: undefined, apiBase: undefined });
    expect(config.admin.token).toBeUndefined();
    expect(config.webhookSecrets).toEqual([]);
    expect(config.worker.httpHost).toBe('0.0.0.0');
    // compose's worker exposes the two ports the example configures.
    expect(compose.services.worker.expose).toEqual([String(config.worker.httpPort), String(config.admin.httpPort)]);
  });

  it('gives a drain more time than SHUTDOWN_GRACE_MS, and runs non-root on a read-only root', () => {
    const grace = Number(byKind('ConfigMap')[0]!.data.SHUTDOWN_GRACE_MS);
    expect(deployment.spec.template.spec.terminationGracePeriodSeconds * 1000).toBeGreaterThan(grace);
    expect(deployment.spec.replicas).toBe(3);
    expect(deployment.spec.template.spec.securityContext.runAsNonRoot).toBe(true);
    expect(worker.securityContext).toMatchObject({ readOnlyRootFilesystem: true, allowPrivilegeEscalation: false });
    expect(compose.services.worker.stop_grace_period).toBe('40s');
  });

  it('compose.yaml validates against the Compose Specification’s JSON schema (vendored, test/vendor/compose-spec)', () => {
    const schema = JSON.parse(read('test/vendor/compose-spec/compose-spec.json'));
    const validate = new Ajv2020({ allErrors: true, strict: false }).compile(schema);
    // As Compose reads it: YAML merge keys (`<<: *outboxd`) resolved.
    const composed = parse(read('deploy/compose.yaml'), { merge: true });
    expect(validate(composed), JSON.stringify(validate.errors)).toBe(true);
    expect(composed.services.worker.image).toBe('outboxd:latest');
    // The schema refuses what Compose refuses.
    expect(validate({ ...composed, services: { ...composed.services, worker: { ...composed.services.worker, stop_grace_period: 40, replicas: 3 } } })).toBe(false);
    expect(validate({ ...composed, services: { ...composed.services, migrate: { ...composed.services.migrate, env_file: [{ required: false }] } } })).toBe(false);
  });

  it('every pod runs as the image’s user, read-only, every capability dropped, as test/processes/image.test.ts runs the image', () => {
    const image = read('deploy/Dockerfile');
    expect(image).toMatch(/^USER node$/m);
    for (const workload of [deployment, job]) {
      const pod = workload.spec.template.spec;
      expect(pod.securityContext, workload.kind).toMatchObject({ runAsNonRoot: true, runAsUser: RUN_AS_USER, runAsGroup: RUN_AS_USER });
      for (const container of pod.containers) {
        expect(container.securityContext, `${workload.kind} ${container.name}`).toEqual({
          allowPrivilegeEscalation: false,
          readOnlyRootFilesystem: true,
          capabilities: { drop: ['ALL'] },
        });
      }
    }
    // The one writable path the worker is given, as the container test gives it (a tmpfs).
    const mounts = worker.volumeMounts.map((m: { mountPath: string }) => m.mountPath);
    expect(mounts).toEqual([WORKER_TMP]);
    expect(job.spec.template.spec.containers[0].volumeMounts).toBeUndefined();
  });

  it('every probe is an HTTP GET on the worker port, at a path the image serves (its HEALTHCHECK too)', () => {
    const served = Object.values(PROBES) as string[];
    for (const probe of [worker.readinessProbe, worker.livenessProbe]) {
      expect(probe.httpGet.port).toBe('http');
      expect(served).toContain(probe.httpGet.path);
    }
    const healthcheck = read('deploy/Dockerfile').match(/^HEALTHCHECK .*\n\s*CMD .*'\/(\w+)'/m);
    expect(healthcheck?.[1] && `/${healthcheck[1]}`).toBe(worker.livenessProbe.httpGet.path);
  });

  it('every env var named in deploy/ is one the config module reads, and .env.example lists them all', () => {
    const named = new Set<string>([
      ...Object.keys(byKind('ConfigMap')[0]!.data),
      ...worker.env.map((e: { name: string }) => e.name),
      ...Object.keys(compose['x-outboxd'].environment),
      ...(docs('deploy/k8s/overlays/example/kustomization.yaml')[0]!.secretGenerator[0].literals as string[]).map((l) => l.split('=')[0]!),
      ...[...read('deploy/Dockerfile').matchAll(/^\s*(?:ENV\s+)?([A-Z_]+)=/gm)].map((m) => m[1]!),
    ]);
    for (const key of named) expect([...CONFIG_KEYS, ...NODE_KEYS], key).toContain(key);
    const example = [...read('deploy/.env.example').matchAll(/^([A-Z_]+)=/gm)].map((m) => m[1]);
    expect(new Set(example)).toEqual(new Set(CONFIG_KEYS));
    const runbook = [...read('docs/runbook.md').matchAll(/^\| `([A-Z_]+)` \|/gm)].map((m) => m[1]);
    expect(new Set(runbook)).toEqual(new Set(CONFIG_KEYS));
  });

  it('the image, the migration Job and compose run the CLI the README documents', () => {
    const dockerfile = read('deploy/Dockerfile');
    const readme = read('README.md');
    // Every stage on one base, node:24-slim unless the build names another (deploy/base-image/build.sh).
    expect(dockerfile).toMatch(/^ARG NODE_IMAGE=node:24-slim$/m);
    expect([...dockerfile.matchAll(/^FROM (\S+)/gm)].map((m) => m[1])).toEqual(['${NODE_IMAGE}', '${NODE_IMAGE}', '${NODE_IMAGE}']);
    // TypeScript 7's compiler is an optional dependency: the build stage keeps optional dependencies.
    expect(dockerfile.split(/^FROM /m)[1]).not.toContain('--omit=optional');
    expect(dockerfile).toMatch(/npm ci --omit=dev/);
    // The image runs the compiled package, as an application that installs it does.
    expect(dockerfile).toMatch(/^RUN npm run build$/m);
    expect(dockerfile).toMatch(/^COPY --from=build \/app\/dist \.\/dist$/m);
    expect(dockerfile).toMatch(/^USER node$/m);
    expect(dockerfile).toContain(`ENTRYPOINT ["/usr/bin/tini", "--", "node", ${DEPLOYED_NODE_ARGS.map((a) => `"${a}", `).join('')}"bin/outboxd.js"]`);
    // node refuses to start on a flag its V8 no longer knows: every container would crash-loop.
    expect(() => execFileSync(process.execPath, [...DEPLOYED_NODE_ARGS, '-e', '0'], { stdio: 'pipe' })).not.toThrow();
    expect(dockerfile).toMatch(/^CMD \["worker"\]$/m);
    expect(dockerfile).toContain(`NODE_OPTIONS="${DEPLOYED_NODE_OPTIONS}"`);
    expect(worker.env.find((e: { name: string }) => e.name === 'NODE_OPTIONS').value).toBe(DEPLOYED_NODE_OPTIONS);
    for (const [name, value] of Object.entries(DEPLOYED_ENV)) {
      expect(dockerfile).toMatch(new RegExp(`^\\s+${name}=${value}$`, 'm'));
      expect(worker.env.find((e: { name: string }) => e.name === name)?.value).toBe(value);
    }
    expect(worker.args).toEqual(['worker']);
    expect(job.spec.template.spec.containers[0].args).toEqual(['migrate']);
    expect(compose.services.migrate.command).toEqual(['migrate']);
    expect(compose.services.worker.command).toEqual(['worker']);
    expect(compose.services.worker.depends_on.migrate.condition).toBe('service_completed_successfully');
    for (const cmd of ['outboxd migrate', 'outboxd worker', 'outboxd stripe-emulator']) expect(readme).toContain(cmd);
    const bin = JSON.parse(read('package.json')).bin.outboxd;
    expect(bin).toBe('bin/outboxd.js');
  });
});
