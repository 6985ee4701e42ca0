// A real OpenID Connect provider on loopback for the sign-on tests: node_modules's
// `oidc-provider` (a certified implementation), installed by tests/oidc.py under the
// cache directory, never in the repository.
//
//   node tests/oidc_provider.mjs NODE_MODULES_DIR SETUP.json
//
// SETUP.json: {"port": 24000, "clients": [...client metadata...],
//              "accounts": {"ada": {"email": "...", "groups": ["llmgw-admins"]}}}
// Each account signs in with its name and any password (the provider's development
// login and consent forms, which the tests submit like a browser). PKCE is required of
// every client, the device authorization grant is on, and `groups` and `email` go into
// the ID token (conformIdTokenClaims off), as Keycloak's and Dex's group mappers do.
// Prints "listening ISSUER" on stdout once it answers.

import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const [modules, setupFile] = process.argv.slice(2);
const setup = JSON.parse(readFileSync(setupFile, 'utf8'));
const load = (...path) => import(pathToFileURL(join(modules, ...path)).href);
const { default: Provider } = await load('oidc-provider', 'lib', 'index.js');
// jose: oidc-provider's own JOSE library, installed beside it.
const jose = await load('jose', 'dist', 'webapi', 'index.js');

// A signing key of this provider's own (not the package's shared development key), so
// another provider's tokens do not verify with this one's published keys.
const { privateKey } = await jose.generateKeyPair('RS256', { extractable: true });
const signingKey = { ...(await jose.exportJWK(privateKey)), kid: `k-${setup.port}`, use: 'sig', alg: 'RS256' };

const issuer = `http://127.0.0.1:${setup.port}`;
const accounts = setup.accounts || {};

const provider = new Provider(issuer, {
  clients: setup.clients,
  jwks: { keys: [signingKey] },
  async findAccount(ctx, id) {
    const account = accounts[id];
    if (!account) return undefined;
    return {
      accountId: id,
      async claims() {
        return { sub: id, preferred_username: id, ...account };
      },
    };
  },
  claims: {
    openid: ['sub'],
    email: ['email', 'email_verified'],
    profile: ['preferred_username', 'name'],
    groups: ['groups'],
  },
  scopes: ['openid', 'offline_access', 'email', 'profile', 'groups'],
  conformIdTokenClaims: false,
  pkce: { required: () => true },
  features: {
    devInteractions: { enabled: true },
    deviceFlow: { enabled: true },
    revocation: { enabled: true },
  },
  ttl: {
    IdToken: setup.idTokenTtl || 3600,
    AccessToken: setup.idTokenTtl || 3600,
  },
  // Loopback tests speak plain HTTP; the cookies would never come back over it if Secure.
  cookies: { keys: ['llmgw-test-cookie-key'] },
});

provider.on('server_error', (ctx, err) => console.error('server_error', err));

provider.listen(setup.port, '127.0.0.1', () => {
  console.log(`listening ${issuer}`);
});
